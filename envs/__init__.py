"""Reference environments, as a user of the cookbook would write them.

``envs.math_env.MathEnv`` (a calculator) and ``envs.tool_use_game.ToolUseGameEnv`` (facts to
look up, then arithmetic), each with bundled tasks in ``data/`` and a scripted expert in
``envs.experts``.
"""
