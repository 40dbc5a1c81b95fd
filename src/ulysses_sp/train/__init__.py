"""``ulysses-sp train``: the training command's building blocks.

    options   the command-line dataclasses (HfArgumentParser)
    launch    validation before launching, torch elastic launch
    worker    one rank: model, data, UlyssesTrainer, staging directory renamed at the end
    tasks     the embedded copy task and default model
    data      real data: load, tokenize (chat templates), pack, collate
    metrics   metrics.jsonl + progress bar callback;  plot: metrics.png
"""
