"""archway's admission webhook, scheduler extender and command line."""
