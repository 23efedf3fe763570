"""What a run needs around the pipeline, used by every stage: devices and precision (``devices``),
finding and loading models (``models``), memory (``memory``, ``huge_pages``), checkpoints (``checkpoint``),
metrics and W&B (``metrics``), the run timeline (``timeline``), progress bars (``progress``),
keeping libraries quiet (``quiet``), sync calls from notebooks (``asyncio_utils``) and the GPU
check (``gpu_check``). Nothing here knows about environments, codecs or losses.
"""
