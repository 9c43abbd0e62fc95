"""Validation of a composed recipe: cross-field rules by concern, run by `validate.validate`.

Sits above the domain packages whose facts the rules read (topology, estimate, model, quant, eval's
sets), so none of them imports it.
"""
