"""Engines execute a StepPlan: ``torch`` runs the real model, ``sim`` a GPU cost model."""
