"""The model runner's host side: the persistent batch its steps update in place (``input_batch``) and the packing
of one step's inputs from it (``step_packing``)."""
