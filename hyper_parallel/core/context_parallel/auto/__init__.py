"""``ContextParallel(mode="auto")``: the mode chosen per shape signature from a calibrated cost model —
the candidates and their predicted times (cost_model.py), the machine's measured numbers
(calibration.py), and the choice made and run (chooser.py)."""
