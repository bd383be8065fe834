"""What a run needs from the processes it runs in, below the model: process-group helpers
(:mod:`.distributed`), the world a launch will build (:mod:`.launch`), restarts and their rendezvous
(:mod:`.elastic`), a rank that stops answering (:mod:`.peers`), preemption signals (:mod:`.preemption`)
and how fast this device multiplies (:mod:`.device_speed`)."""
