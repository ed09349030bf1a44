"""One module per fault type; each defines `FAULT` (see fakevendor/faults/base.py and registry.py)."""
