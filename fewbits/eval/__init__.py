"""Measuring what quantisation costs: perplexity, KL divergence and top-1 agreement against the
unquantised model (overall and per category of text), encoder embedding cosine, and reports."""
