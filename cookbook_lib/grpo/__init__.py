"""Multi-turn GRPO: the run's config, advantages, samples, losses and the training loops.

``config`` holds :class:`~cookbook_lib.grpo.config.GRPOConfig`, which imports neither torch nor
transformers, so a config can be loaded and checked before anything heavy is imported.
"""
