"""Datasets: data/<name>/prepare.py per dataset; tokens.py (the token files) and corpus.py (the
shared preparation routine) serve them all. A package, so `data.tokens` cannot resolve to
another installed module called `data`."""
