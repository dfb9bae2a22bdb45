"""ddp_course: PyTorch distributed training, taught by running it.

The core: config (TrainConfig), data (corpus, tokenizer, batches), model (MiniGPT), dist (process
group set-up), parallel (one module per strategy), train (the loop), checkpoint, metrics, launch
(torchrun from a notebook), cli (the option parser). The command line: __main__, bench, check,
doctor. Lesson material: ddp_course.course, one folder per notebook. See docs/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
