"""generate()'s worker side: each worker's stages run eagerly over the sequence lanes of a step, with their key/value caches."""
