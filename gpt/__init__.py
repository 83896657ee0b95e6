"""The trainer's library, a folder per job: device < data < outdir < train, weights < inference,
evaluation, each importing only the folders before it (tests/test_layout.py). The commands at the
repository's root call it; it calls model.py and configurator.py, and never a command."""
