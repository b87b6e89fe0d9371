"""ResNet-50 on ImageNet at a global batch of 64K: the large-batch recipe as a Lightning script.

Jia et al. 2018 (Tencent, arXiv:1807.11205): batch 64K, 90 epochs, mixed precision with LARS,
no weight decay on bias/BN, zero-init residual BN gamma, hierarchical all-reduce (75.8 % top-1
on 2048 P40). LR schedule, LARS settings, weight decay and label smoothing follow the MLPerf
ResNet-50 LARS reference (lars_util.py: peak LR 31.2 and 25 warmup epochs for batch >= 32768,
poly power 2 to 1e-4; README_tensorflow2.md: momentum 0.9, lars_epsilon 0, label smoothing 0.1,
weight decay 2e-4). The Hydra preset ``experiment=imagenet_resnet50_64k`` holds the same values.

Run::

    python examples/imagenet_resnet50.py --fast-dev-run        # seconds, CPU, built-in data
    torchrun --nnodes 256 --nproc_per_node 8 ... examples/imagenet_resnet50.py \\
        --data-root /data/imagenet --num-nodes 256 --devices 8
"""
from __future__ import annotations

from _imagenet_recipe import Recipe, parse_args, run

RESNET50_64K = Recipe(
    model="resnet50",
    global_batch={0: 65536},   # Jia et al. 2018: 64K from the first epoch
    max_per_device_batch=256,  # memory ceiling of one device; accumulation above it
    epochs=90,                 # Jia et al. 2018
    lr=31.2,                   # MLPerf lars_util: peak LR for batch >= 32768 (absolute)
    weight_decay=2e-4,         # MLPerf README_tensorflow2.md; bias/BN get 0 (Jia et al.)
    warmup_epochs=25,          # MLPerf lars_util: 25 epochs for batch >= 32768
    end_lr=1e-4,               # MLPerf lars_util
    reference_batch=None,      # lr is already the 64K peak LR
    eta=0.001,                 # You et al. 2017; MLPerf LARSOptimizer
    eps=0.0,                   # MLPerf README_tensorflow2.md: lars_epsilon=0
    label_smoothing=0.1,       # MLPerf README_tensorflow2.md; Szegedy et al. 2016
    zero_init_residual=True,   # Goyal et al. 2017; Jia et al. 2018
)

if __name__ == "__main__":
    run(RESNET50_64K, parse_args(__doc__.splitlines()[0]))
