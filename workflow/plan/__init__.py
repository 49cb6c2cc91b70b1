"""What a campaign runs, checked before any work: the schema's keys, runs, targets, screens, sizes, devices."""
