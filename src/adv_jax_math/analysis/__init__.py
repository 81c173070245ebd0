"""Analysis of traced programs: jaxpr walking, reduction recognition, the
associativity check, separability, the pairing reader, tangents and argument checks.
"""
