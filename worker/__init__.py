"""GPU worker: model, engines, the in-GPU batch builder and the loop that drives them."""
