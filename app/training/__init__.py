"""Training, jointly on acting and rehearsing.

- `rows`: Act and Rehearse rows from traces (expert replays, self-training, corrections).
- `agent`: the shipped adapter (expert rows -> joint training -> reward-filtered self-training).
- `finetune`: light fine-tuning on a person's corrections, registered as a new adapter.
- `trl_export`: rows as TRL conversational JSONL, for training at scale.
- `memory_seed`: the rehearsal memory's seed of real transitions from the training split.

What the Fine-tune tab asks of `finetune` (the form, the job, its figures) is `app.service.finetune`.
"""
