"""Planning: pin the inputs, stage every object (its ranges, summaries), bucket globally by
work and cut shards sized by it.

What the other stages call: `pin_job` (submitted -> planning), `plan_objects` (stage objects on
this machine), `plan_one_object` and `plan_sent_part` (a worker's planning tasks) and
`finish_plan` (the global step: planning -> running). Shard naming (`planning.shard_names`) and
sizing (`planning.sizing`) are modules of their own, for executors that cut shards too.

  pin.py          list and pin the inputs, within the job's bounds
  context.py      `Planning(job)`: what a planning task shares; one object's task from its index
  stage.py        stage one object or part; the planning tasks and their ledger bookkeeping
  ranges.py       large objects planned in parts
  summary.py      what a staged part leaves for the global step
  finish.py       the global step: duplicates, buckets, shards
  bucketing.py    the global step's arithmetic over summaries, and its readers
  sizing.py       shard sizes by work
  shard_names.py  shard ids and files
"""

from batchinf.planning.finish import finish_plan
from batchinf.planning.pin import pin_job
from batchinf.planning.stage import plan_objects, plan_one_object, plan_sent_part

__all__ = ["finish_plan", "pin_job", "plan_objects", "plan_one_object", "plan_sent_part"]
