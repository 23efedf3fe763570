"""Everything that draws: the episode viewer (``viewer``), end-cause and reward charts (``plots``),
training curves (``training_plots``), the run timeline (``timeline_plots``) and the length mix of
runs side by side (``length_mix_plots``). These read episodes, metrics and timelines; nothing in
the pipeline imports them.
"""
