"""RL algorithms, rewards, verifiers, tasks and datasets. Knows nothing about placement or transport."""
