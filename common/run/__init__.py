"""Running a job: the loop, the trainer template, rollouts, checkpoints, logging, the schedule, capabilities."""
