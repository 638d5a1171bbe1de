"""Models behind one small interface (models.base): a light spec and a loaded model."""
