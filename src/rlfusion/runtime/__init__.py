"""Controller loop, RL stages, run configuration, checkpoint/resume. Knows no tensor math beyond calling the stages."""
