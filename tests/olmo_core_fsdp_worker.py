"""OLMo-core training the reference model (tests/olmo_core_reference.py) with FSDP over 2 CPU
processes (gloo), then saving with its Checkpointer: every tensor of model_and_optim/ is then
stored in 2 shards, one per rank, as in AI2's published checkpoints (many ranks there).

    python tests/olmo_core_fsdp_worker.py <out dir> <port>     -> <out dir>/step2/
"""
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import olmo_core_reference as R  # noqa: E402

WORLD = 2


def main(rank: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.train.checkpoint import Checkpointer
    from olmo_core.train.train_module import TransformerDataParallelConfig
    torch.manual_seed(0)
    model = R.olmo_core_config().build(init_device="cpu")
    model.init_weights(device=torch.device("cpu"))
    tm = R.train_module(model, torch, rank_batch=1,
                        dp_config=TransformerDataParallelConfig(name=DataParallelType.fsdp))
    data = R.batches()
    for i in range(R.STEPS):  # each rank its own row of the global batch
        R.step(tm, data[i][rank:rank + 1], torch)
    Checkpointer(work_dir=os.path.join(out, f"work{rank}"), process_group=dist.group.WORLD).save(
        os.path.join(out, f"step{R.STEPS}"), tm, {"global_step": R.STEPS})
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp
    mp.spawn(main, args=(sys.argv[1], sys.argv[2]), nprocs=WORLD)
