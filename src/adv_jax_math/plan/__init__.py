"""Planning: a validated call to a plan (chunks, reduction, policy), autotuning and
the roofline models. Data in, decisions out; imports no kernel and no engine.
"""
