"""Small pure pieces that recipes are made of."""
