"""Stage 4, place and fragment: every equation and input gets a submesh, then runs of
same-submesh equations become fragments (``_partition``); ``_inputs`` says in which sharding
each program input arrives."""
