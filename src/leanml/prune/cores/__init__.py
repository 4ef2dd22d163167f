"""Pure tensor math of every pruning method: functions of weights and statistics, no model objects, no I/O.

One module per method (``fista``, ``fasp``, ``sparsegpt``, ``wanda``, ``magnitude``) plus ``refine``, the
least-squares refit on a fixed support that FISTA uses. The pruners in :mod:`leanml.prune.methods` call these.
"""
