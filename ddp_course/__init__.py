"""ddp_course: PyTorch distributed training, taught by running it.

Modules: config (TrainConfig), data (corpus, tokenizer, dataset), model (MiniGPT), dist (process
group set-up), parallel (one module per technique), train (the loop), launch (torchrun from a
notebook), metrics, checkpoint, plots, bench, check, doctor.
"""

__version__ = "0.1.0"
