"""The planner: `model.py` (the capacity model and cost-aware activation, closed forms), `simulator.py` (a
discrete-event simulation of the rules the coordinator runs, to check the model against) and `io.py` (pool files,
a finished run's measurements, the plot) for `echo2 plan`. Pure Python: nothing here imports torch or vLLM."""
