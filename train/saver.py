"""A training run's checkpoints: resume from the newest readable one, save, report each save once it is complete
(orbax saves asynchronously), and mark the run resumable once its first checkpoint is complete."""

import jax

from rundir import checkpoints
from rundir import metrics as metrics_file
from rundir.config_layout import up_to_date
from train.state import abstract_state


class Saver:
    def __init__(self, rc, run_dir, tokenizer_path, say=print):
        self.rc, self.run_dir, self.tokenizer_path, self.say = rc, run_dir, tokenizer_path, say
        self.mngr = checkpoints.manager(run_dir.checkpoints, rc.checkpoint.keep, rc.checkpoint.async_save)
        self.last_saved = None  # the newest step saved (or restored): what a NaN stop names
        self.restored_config = None  # the run config the restored checkpoint was written with (today's layout)
        self.saving = []  # steps whose save has not been reported complete yet

    def restore(self, state):
        """(state, start step): the newest readable checkpoint's, or `state` and 0. On resume, the metrics the
        stopped run logged after that checkpoint are dropped (they are logged again) and the run is marked
        resumable (a run written before the marker existed gets it)."""
        restored, meta = checkpoints.restore_latest(self.mngr, abstract_state(state), self.rc.model, self.say)
        start = 0 if restored is None else int(meta["data_position"])
        if jax.process_index() == 0:
            dropped = metrics_file.truncate_after(self.run_dir.metrics, start)
            if dropped:
                self.say(f"metrics.jsonl: dropped {dropped} row(s) after step {start} (a stopped run logged them; "
                         "they are logged again)")
            if restored is not None and not (self.run_dir.read_marker() or {}).get("checkpointed"):
                self.run_dir.write_marker(checkpointed=True)
        if restored is None:
            return state, 0
        self.last_saved, self.restored_config = start, up_to_date(meta["config"])
        return restored, start

    def save(self, step: int, state, line) -> None:
        """Start saving `step`; `line` reports completed saves. The first checkpoint of a run is waited for: from
        then on the run can resume, which the marker records."""
        first = self.last_saved is None
        self.report(line)  # the previous save, if it has finished meanwhile
        checkpoints.save(self.mngr, step, state, self.rc, self.tokenizer_path)
        self.last_saved = step
        self.saving.append(step)
        if first:
            self.mngr.wait_until_finished()
            if jax.process_index() == 0:
                self.run_dir.write_marker(checkpointed=True)
        self.report(line)

    def report(self, line, wait: bool = False) -> None:
        if self.saving and (wait or not self.mngr.is_saving_in_progress()):
            if wait:
                self.mngr.wait_until_finished()
            for s in self.saving:
                line(f"step {s}: saved checkpoint {self.run_dir.checkpoints / str(s)}")
            self.saving.clear()

    def close(self) -> None:
        self.mngr.wait_until_finished()
        self.mngr.close()
