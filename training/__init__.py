"""Training above the engine interface: the epoch loop, LR schedule, checkpoint/resume, evaluation."""
