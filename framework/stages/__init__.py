"""The stages beside fit, peers above the loop: validate and test a saved run's weights (`evaluate`), predict
(`predictions` writes them), the LR range test (`lr_find`), and export (`export`)."""
