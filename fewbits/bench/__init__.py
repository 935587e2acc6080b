"""Measuring this machine (`probe`) and real decode speed against the cost model (`decode`)."""
