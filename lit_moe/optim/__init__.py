"""Optimizers and what drives them: the ``optimizer:`` section (:mod:`.optimizers`: AdamW with stored
moments, Muon, parameter groups), the ``lr_scheduler:`` section and batch ramp-up (:mod:`.schedules`), and
MuonClip's QK-clip after each step (:mod:`.qk_clip`)."""
