"""Replica groups as train.py holds them: one object, whatever the run. of(cfg) gives this
group's torchft_groups.Groups when ft_replica_group is set (fault-tolerant replica groups:
gpt/train/torchft_groups.py), else Alone, whose every answer is a plain run's. torchft takes about a
second to import, and only replica groups need it: it is imported only then.

    groups = replicas.of(cfg)
    cfg = groups.out_dir(cfg)             # a group's own out_dir/group<g>: one writer per file
    groups.count                          # the groups that share the global batch, as ranks do
    rt_of_batches = groups.data_view(rt)  # rank r of group g draws as rank g x W + r of R x W would
    groups.join(run, outer)               # torchft's wrappers around run.train_model and run.optimizer
    it = groups.step_done(it)             # the step count after step it: a healed group jumps to its peers'
    groups.participants                   # the groups that took part in the last step: their tokens trained
    groups.log()                          # the step record's fields ({} alone)
    groups.checkpoint()                   # a checkpoint's fields beside the weights ({} alone)
    groups.shutdown()                     # leave the groups
"""


class Alone:
    """A run without replica groups."""

    count = participants = 1

    def out_dir(self, cfg):
        return cfg

    def data_view(self, rt):
        return rt

    def join(self, run, outer=None):
        pass

    def step_done(self, it):
        return it + 1

    def log(self):
        return {}

    def checkpoint(self):
        return {}

    def shutdown(self):
        pass


def of(cfg):
    """This process's replica groups: torchft's with ft_replica_group set, else Alone."""
    if cfg.ft_replica_group < 0:
        return Alone()
    from gpt.train import torchft_groups  # here, not at the top: torchft takes a second to import

    return torchft_groups.Groups(cfg)
