"""The subcommands beside ``fit``: ``convert-config`` (:mod:`.convert_config`), ``predict``
(:mod:`.predict`), and the one-line error handling every path-taking tool shares (:mod:`.errors`).
``lit_moe plan`` is the planner of :mod:`lit_moe.strategies.plan`; ``convert-hf`` lives with the
checkpoint formats (:mod:`lit_moe.hf.convert`); ``preprocess`` with the data
(:mod:`lit_moe.data.preprocess`)."""
