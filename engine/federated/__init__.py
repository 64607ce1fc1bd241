"""The federated roles: what a client and the server compute in one round.

A client (:mod:`.client`) trains the round's model on its examples
(:mod:`.local_training` one by one, :mod:`.vectorized` as vectorised groups), clips
its update and adds it to its worker's partial sum; the server (:mod:`.server`)
reduces the partial sums, adds the round's noise through the privacy room
(:mod:`engine.privacy`) and steps the global model. :mod:`.client_state` keeps the
personal state of personalised recipes, :mod:`.worker_model` the model and data each
worker process holds, :mod:`.evaluation` the accuracy and loss of a model on a set.
"""
