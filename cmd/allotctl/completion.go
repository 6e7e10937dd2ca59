package main

import (
	"github.com/spf13/cobra"
)

func (a *app) completionCmd(root *cobra.Command) *cobra.Command {
	return &cobra.Command{
		Use:   "completion bash|zsh|fish",
		Short: "Print a shell completion script",
		Long: `completion prints a completion script for bash, zsh or fish. Load it in the
current shell, or install it where your shell looks for completions.`,
		Example: `  source <(allotctl completion bash)
  allotctl completion bash > /etc/bash_completion.d/allotctl
  allotctl completion zsh > "${fpath[1]}/_allotctl"
  allotctl completion fish > ~/.config/fish/completions/allotctl.fish`,
		ValidArgs: []string{"bash", "zsh", "fish"},
		Args:      cobra.MatchAll(cobra.ExactArgs(1), cobra.OnlyValidArgs),
		RunE: func(cmd *cobra.Command, args []string) error {
			switch args[0] {
			case "bash":
				return root.GenBashCompletionV2(a.stdout, true)
			case "zsh":
				return root.GenZshCompletion(a.stdout)
			default:
				return root.GenFishCompletion(a.stdout, true)
			}
		},
	}
}
