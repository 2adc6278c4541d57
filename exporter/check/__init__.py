"""`shmwatch check`: the operator's questions answered from the model, with advice."""
