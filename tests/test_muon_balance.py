"""Muon's matrices shared out across ranks by shape and FLOPs (gpt/train/muon.py's assign): the busiest
rank's Newton-Schulz FLOPs within 1.1x of an even share. `pytest -s` prints docs/distributed.md's table."""

import pytest

from gpt.train.muon import assign, ns_flops

# the blocks' matrices of config/train_gpt2.py (12 layers of 768) and config/train_llama_1b.py (16 of
# 2048, 8 key/value heads of 64, SwiGLU 8192 wide), as {shape: count}
GPT2_124M = {(2304, 768): 12, (768, 768): 12, (3072, 768): 12, (768, 3072): 12}
LLAMA_1B = {(3072, 2048): 16, (2048, 2048): 16, (16384, 2048): 16, (2048, 8192): 16}
MODELS = {"GPT-2 124M": GPT2_124M, "Llama 1B": LLAMA_1B}
WORLD_SIZES = (2, 4, 8, 16)


def runs(counts, world_size):
    """The assignment before assign: each shape's k matrices in contiguous runs, rank r owning [r k // N, (r + 1) k // N)."""
    owners = {}
    for shape, k in counts.items():
        bounds = [r * k // world_size for r in range(world_size + 1)]
        owners[shape] = [r for r in range(world_size) for _ in range(bounds[r + 1] - bounds[r])]
    return owners


def busiest(counts, world_size, owners):
    """(the busiest rank's Newton-Schulz FLOPs over an even share, its GFLOPs, the padding matrices the
    collectives carry)."""
    load = [0] * world_size
    for shape, ranks in owners.items():
        assert len(ranks) == counts[shape] and set(ranks) <= set(range(world_size))  # one owner each
        for r in ranks:
            load[r] += ns_flops(shape)
    padding = sum(world_size * max(ranks.count(r) for r in range(world_size)) - len(ranks) for ranks in owners.values())
    return max(load) * world_size / sum(load), max(load) / 1e9, padding


def table():
    """docs/distributed.md's table: each model and world size, before (runs) and after (assign)."""
    lines = [
        "| model | ranks | runs of each shape | assign | padding, matrices (runs / assign) |",
        "|---|---|---|---|---|",
    ]
    for name, counts in MODELS.items():
        for n in WORLD_SIZES:
            (b, bg, bp), (a, ag, ap) = busiest(counts, n, runs(counts, n)), busiest(counts, n, assign(counts, n))
            lines.append(f"| {name} | {n} | {b:.3f}x ({bg:,.0f} GFLOP) | {a:.3f}x ({ag:,.0f} GFLOP) | {bp} / {ap} |")
    return "\n".join(lines)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("model", MODELS)
def test_the_busiest_rank_does_at_most_1_1x_an_even_share(model, world_size):
    counts = MODELS[model]
    owners = assign(counts, world_size)
    assert list(owners) == list(counts)
    assert busiest(counts, world_size, owners)[0] <= 1.1


def test_the_runs_it_replaces_were_not_balanced():
    """The table's before column: the busiest of 8 ranks did 1.33x on GPT-2 124M (254 GFLOP against 190)."""
    ratio, gflop, _ = busiest(GPT2_124M, 8, runs(GPT2_124M, 8))
    assert ratio == pytest.approx(4 / 3) and round(gflop) == 254
    print("\n" + table())
