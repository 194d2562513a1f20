"""Planning: pin the inputs, stage every object (its ranges, summaries), bucket globally by
work and cut shards sized by it."""
