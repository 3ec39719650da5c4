"""What the mlx backend runs, without importing mlx: the one list the config, the planner and
the runtime check against (tests/test_capabilities.py walks it against the runtime).

Adding an optimizer: its name here, its constructor in ``runtime.OPTIMIZERS``, its state bytes
in the planner's memory model, a YAML in conf/optim/, and a test.
"""

from finetune.backends.base import Capabilities

CAPABILITIES = Capabilities(
    name="mlx",
    methods=("lora", "dora", "qlora", "full"),
    optimizers=("adamw", "adam", "sgd", "adafactor"),
    # precision: weight dtype (None = as stored); no autocast in MLX
    precisions={"auto": (None, None), "32-true": ("float32", None), "bf16-true": ("bfloat16", None)},
    attn_implementations=("auto", "sdpa"),  # mx.fast.scaled_dot_product_attention; the key is cuda's
    why_not={"optim.name": "needs backend=cuda (bitsandbytes)", "precision.name": "needs autocast, which MLX lacks",
             "backend.strategy": "(sharding) needs backend=cuda (FSDP2)"},
    nvml=False,
    cache_limit=True,  # mx.set_cache_limit: the governor sizes it from the measured step
    strategies=("ddp",),  # under mlx.launch: replicated, gradients summed with mx.distributed.all_sum
    # memory.cache_limit=auto: never below MLX's own default cache (32 MiB, mlx allocator.cpp),
    # so small steps keep the reuse they had
    min_cache_limit_bytes=32 << 20,
    # an Apple GPU: MLX reuses a freed Metal buffer only for a request within two pages of its
    # size, so repeated shapes matter; mlx-lm pads the same way (finetune/data/batches.py pad_multiple)
    default_pad_multiple={"mlx:gpu": 32},
    no_activation_offload="on mlx memory is unified (the GPU's memory is the host's): there is no host memory to "
                          "offload to; set train.activation_offload=false (train.grad_checkpointing saves activations)",
    no_cpu_offload="no offload applies on mlx: memory is unified (the GPU's memory is the host's); set "
                   "backend.cpu_offload=false",
    pre_quantized=True,  # mlx_lm.convert -q checkpoints: mlx_lm.load rebuilds their quantized layers
    adapter_format="mlx",
    limits_event="set_mlx_limits",
    cache_limit_event="set_mlx_cache_limit",
    framework="mlx",
    install="backend=mlx needs mlx: pip install '.[mlx]' (on Linux this brings mlx[cpu])",
)
