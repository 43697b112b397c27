"""Both benchmark tables, dispatch paths side by side:

    python -m benchmarks.run --preset cpu        # small shapes, for a laptop / CI box
    python -m benchmarks.run --preset gpu        # the H100 goal shapes (bf16, sequence 2048)
"""

import sys

from benchmarks import moe_layer, train_step

if __name__ == "__main__":
    print("## MoE layer (routed experts, forward + backward) vs a dense FFN with the same active FLOPs")
    moe_layer.main(sys.argv[1:])
    print("\n## Train step")
    train_step.main(sys.argv[1:])
