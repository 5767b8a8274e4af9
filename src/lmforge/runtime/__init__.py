"""What training and evaluation share: the run directory, checkpoint IO (DCP, atomic commit), Hugging Face model
folders, and building the run's model for this rank."""
