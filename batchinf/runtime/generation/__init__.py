"""Text generation over a decoder: prompts (prompts.py), a pure-Python scheduler that plans each
step (scheduler.py) over the KV cache's slots and budget (kv.py), an engine that runs a plan
(engine.py), sampling, structured output and stop conditions, behind `runtime.GenerateRuntime`."""
