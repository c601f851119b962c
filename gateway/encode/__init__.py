"""Encoding: the encoder backends' client, vLLM's encoder instances primed, local encoders supervised."""
