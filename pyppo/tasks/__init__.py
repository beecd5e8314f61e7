"""Procedural task generators as prompt sources, each with its own reward: reasoning-gym's tasks
(:mod:`.reasoning_gym`, ``--prompts reasoning-gym:TASK``, ``--reward reasoning-gym``)."""
