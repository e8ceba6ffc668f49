"""tiny_lm: a ~7M-parameter Llama-style model on Python source (a 4096-token BPE); a few minutes on a 2-core CPU."""

from jaxlm.config import DataConfig, ModelConfig, OptimConfig, TrainConfig

config = TrainConfig(
    model=ModelConfig(
        d_model=256,
        num_layers=6,
        num_heads=4,
        num_kv_heads=2,
        mlp_dim=1024,
        max_seq_len=256,
    ),  # the library's speed defaults: unrolled layers, auto attention, auto microbatches (4 of 4 rows on CPU)
    optim=OptimConfig(learning_rate=3e-3, warmup_steps=20, min_lr_ratio=0.1, weight_decay=0.1, grad_clip=1.0),
    # The default corpus with a 4096-token BPE trained on it: at equal training FLOPs 0.77x the byte-level bits per
    # byte, and no slower (docs/results/compare_tokenizers.md)
    data=DataConfig(seq_len=256, batch_size=16, val_fraction=0.01, eval_batches=4, corpus_tokenizer="bpe4096"),
    steps=160,
    log_every=10,
    eval_every=40,
    eval_prompts="def |class |import ",  # greedy samples at each eval: watch it learn Python
    checkpoint_every=40,
)
