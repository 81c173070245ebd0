"""Pairwise reductions ``out_i = reduce_j f(x_i, y_j)``: the public ``pairwise``,
its tile policy, plan and kernels, derivatives, its scan route and the rows-pairing engine.
"""
