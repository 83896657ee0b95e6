"""Datasets: data/<name>/prepare.py per dataset, and corpus.py, the preparation routine they
share. Preparation only: what training reads at run time (the token files, the chat template)
is library code in gpt/. A package, so `data.corpus` cannot resolve to another installed module
called `data`."""
