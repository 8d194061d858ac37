"""Self-check and benchmark harness behind ``python -m ffpa_attn`` (see :mod:`ffpa_attn.cli`).

Modules, one job each: :mod:`.results` (data model + JSON), :mod:`.timing` (CUDA-event medians, peak
memory), :mod:`.impls` (our backends and the peers behind one interface), :mod:`.upstream` (the public
ffpa-attn under an alias), :mod:`.runner` (the sweep), :mod:`.report` (text / Markdown tables),
:mod:`.plot` (PNG), :mod:`.check` (the self-check), :mod:`.env` (versions, GPU, commit),
:mod:`.progress` (progress bar). Importing this package imports no kernel module.
"""
